"""What the draft and the target worker share: the engine the roles build on (engine.py), which
ties a worker's sessions with their KV caches (sessions.py) to the passes on its model
(runner.py); their settings (config.py) and one gRPC server parameterised by role (server.py). The roles themselves
live in draft_service/ and target_service/; nothing here imports them."""
