"""python -m rawkv demo | nvrtc-check | warmup"""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv.pop(0) if argv else "demo"
    if cmd == "demo":
        from .demo import main as demo_main
        return demo_main(argv)
    if cmd == "nvrtc-check":
        from .tools.nvrtc_check import main as check_main
        return check_main(argv)
    if cmd == "warmup":
        from . import GpuUnavailableError, warmup
        try:
            rt = warmup()
        except GpuUnavailableError as exc:   # an expected state, not a crash: no traceback
            print(f"rawkv warmup: {exc}", file=sys.stderr)
            return 2
        print(rt, rt.stats)
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
