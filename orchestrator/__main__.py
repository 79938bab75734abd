"""`python -m orchestrator`: see orchestrator/server.py."""
from specdec.threads import bound_openmp_spinning

bound_openmp_spinning()  # before torch is imported: it shares the host's cores with workers

from orchestrator.server import main  # noqa: E402

main()
