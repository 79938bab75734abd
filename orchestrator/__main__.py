"""`python -m orchestrator`: see orchestrator/server.py."""
from specdec.lifetime import die_with_supervisor
from specdec.threads import bound_openmp_spinning

die_with_supervisor()  # a no-op unless `specdec serve` started this process
bound_openmp_spinning()  # before torch is imported: it shares the host's cores with workers

from orchestrator.server import main  # noqa: E402

main()
