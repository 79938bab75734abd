"""The tools on top of the runtime: the command line, the local stack, the benchmarks, the load test
and the timeline.

Nothing in specdec/, draft_service/, target_service/ or orchestrator/ imports this package.
"""

PLOTS_EXTRA = "pip install 'specdec-service[plots]'"  # matplotlib: the pictures are optional


def can_plot(picture: str) -> bool:
    """Whether matplotlib is installed; if not, says which picture is skipped and how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        import sys

        print(f"[specdec] {picture} not drawn: matplotlib is not installed ({PLOTS_EXTRA})", file=sys.stderr)
        return False
    return True
