"""The target worker: the large causal LM that verifies a round's drafts in one forward pass.

`python -m target_service`: role.py says what a target is, specdec/worker/server.py serves it,
servicer.py maps gRPC to engine.py, which does the model work.
"""
from specdec.threads import bound_openmp_spinning

bound_openmp_spinning()  # before torch is imported (specdec/threads.py says why)

from specdec.lifetime import die_with_supervisor  # noqa: E402

die_with_supervisor()  # a no-op unless `specdec serve` started this process

from specdec.worker.config import DEFAULT_PORTS, WorkerConfig  # noqa: E402

# the flags first: --help, --version and a bad flag answer before torch and the model code load
config = WorkerConfig.from_args("target", default_port=DEFAULT_PORTS["target"])

from target_service.role import TARGET  # noqa: E402
from specdec.worker.server import main  # noqa: E402

main(TARGET, config=config)
