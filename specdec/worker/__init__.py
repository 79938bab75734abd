"""What the draft and the target worker share: sessions with KV caches (engine.py), their
settings (config.py) and one gRPC server parameterised by role (server.py). The roles themselves
live in draft_service/ and target_service/; nothing here imports them."""
