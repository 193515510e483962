"""The ragged offsets rule's cases, shared by the W4A16 and W4A8 reference
tests (numpy only)."""

# (offsets, the rule's clamped offsets, errors counted) over 9 rows: the
# ragged offsets rule (docs/gemm.md, "Ragged offsets") both references follow.
RAGGED_OFFSET_CASES = [
    ([0, 3, 5, 9], [0, 3, 5, 9], 0),                    # in order, covers all rows
    ([0, 0, 4, 4, 9], [0, 0, 4, 4, 9], 0),              # empty experts
    ([2, 4, 7], [2, 4, 7], 0),                          # rows 0, 1, 7, 8 owned by nobody
    ([0, 6, 3, 9], [0, 6, 6, 9], 1),                    # out of order
    ([0, 4, 100, 2], [0, 4, 9, 9], 2),                  # past R, then back
    ([-3, 2, 2, 5], [0, 2, 2, 5], 1),                   # negative
    ([-5, -1, 12, 40], [0, 0, 9, 9], 4),
]
