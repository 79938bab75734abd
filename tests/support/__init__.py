"""What many tests share: real servers on free ports (servers.py), worker processes (processes.py)."""
