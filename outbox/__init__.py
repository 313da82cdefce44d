"""The transactional outbox (table, relay, retention) — arrives with its issue."""

__all__: list[str] = []
