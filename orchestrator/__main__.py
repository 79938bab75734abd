"""`python -m orchestrator`: see orchestrator/server.py."""
from specdec.threads import bound_openmp_spinning

bound_openmp_spinning()  # before torch is imported: it shares the host's cores with workers

from specdec.lifetime import die_with_supervisor  # noqa: E402

die_with_supervisor()  # a no-op unless `specdec serve` started this process

from orchestrator.config import OrchestratorConfig  # noqa: E402

# the flags first: --help, --version and a bad flag answer before torch and the model code load
config = OrchestratorConfig.from_args()

from orchestrator.server import main  # noqa: E402

main(config=config)
