"""What txmq's servers share — the broker, the name server and the controller — and clients
never use: listening and serving connections under limits (:mod:`.serving`) and state kept
in JSON files that survive a damaged write (:mod:`.jsonfile`)."""

from txmq.server.serving import ConnectionSettings, EmbeddedServer

__all__ = ["ConnectionSettings", "EmbeddedServer"]
