"""The tools on top of the runtime: the command line, the local stack, the benchmarks, the load test
and the timeline.

Nothing in specdec/, draft_service/, target_service/ or orchestrator/ imports this package.
"""
