"""The tools on top of the runtime: the local stack, the benchmarks, the load test and the timeline,
as commands of `specdec` (cli.py; orchestrator/cli.py finds them through the entry-point group
specdec.commands where this package is installed). Their dependencies are the `bench` extra
(`pip install '.[bench]'`); the service image leaves them out.

Nothing in specdec/, draft_service/, target_service/ or orchestrator/ imports this package: the
tools import the runtime, never the reverse (tests/specdec/test_import_graph.py).
"""

PLOTS_EXTRA = "pip install '.[bench]' from a checkout"  # matplotlib: the pictures are optional


def can_plot(picture: str) -> bool:
    """Whether matplotlib is installed; if not, says which picture is skipped and how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        import sys

        print(f"[specdec] {picture} not drawn: matplotlib is not installed ({PLOTS_EXTRA})", file=sys.stderr)
        return False
    return True
