"""python -m rawkv COMMAND [options]; `python -m rawkv --help` lists the commands."""
import argparse
import sys


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit status 2: argparse's
    default prints the whole usage first, which buries the message."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from . import bench, demo, demo_layer
    from .bench import cli as bench_cli
    p = _Parser(prog="python -m rawkv", description="rawkv: NVFP4 and compressed-KV-cache CUDA "
                "kernels compiled at run time with NVRTC.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    d = sub.add_parser("demo", help="one DeepSeek-V4-Flash decoder layer's decode step on rawkv against "
                       "BF16 torch (without a GPU: the numpy reference at a small size); --cache: the "
                       "compressed KV cache demo", description=demo_layer.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(d)
    demo_layer.add_arguments(d)
    d.set_defaults(parser=d)
    b = sub.add_parser("bench", help="the benchmark suite on a CUDA GPU: a table per group, JSON "
                       "files and figures", description=bench.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_cli.add_arguments(b)
    b.set_defaults(parser=b)
    # listed here; main() hands its options to the compile-check's own parser
    sub.add_parser("nvrtc-check", add_help=False,
                   help="compile every kernel with NVRTC, no GPU needed (see nvrtc-check --help)")
    w = sub.add_parser("warmup", help="compile or load from the disk cache every kernel for the "
                       "current CUDA device", description="Compile (or load from the disk cache) "
                       "every rawkv kernel for torch's current CUDA device.")
    w.set_defaults(parser=w)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["nvrtc-check"]:     # argparse cannot pass on options it does not know
        from .tools.nvrtc_check import main as check_main
        return check_main(argv[1:])
    p = _parser()
    a, extra = p.parse_known_args(argv)
    if extra:       # refused by the command's parser, so the error points at its --help
        getattr(a, "parser", p).error(f"unrecognized arguments: {' '.join(extra)}")
    if a.command is None:
        p.print_help(sys.stderr)
        return 2
    if a.command == "demo":
        from . import demo, demo_layer
        demo_layer.check_arguments(a, a.parser.error)
        if not a.cache:
            return demo_layer.main(a)
        demo.check_arguments(a, a.parser.error)
        return demo.run(a)
    if a.command == "bench":
        from .bench.cli import check_arguments, run
        check_arguments(a, a.parser.error)
        return run(a)
    from . import GpuUnavailableError, warmup
    try:
        rt = warmup()
    except GpuUnavailableError as exc:   # an expected state, not a crash: no traceback
        print(f"rawkv warmup: {exc}", file=sys.stderr)
        return 2
    print(rt, rt.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
