"""What the broker does for consumers: pulls with long polling (:mod:`.pulling`), RocketMQ
5's pop consumption (:mod:`.pop`), and retries and dead letters (:mod:`.retry`)."""
