"""A script of tools/ loaded as a module, for the tests of the tools."""
import importlib.util
import pathlib

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    """tools/<name>.py as a fresh module named `name`."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
