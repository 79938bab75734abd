"""`python -m orchestrator`: see orchestrator/server.py."""
from specdec.threads import prefer_passive_openmp

prefer_passive_openmp()  # before torch is imported: it shares the host's cores with workers

from orchestrator.server import main  # noqa: E402

main()
