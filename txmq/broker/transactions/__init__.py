"""The broker's transactions (two-phase commit): half messages and their op records, the
transaction log kept in memory and recovered from them (:mod:`.service`), the check-back
with the producer group and parking (:mod:`.check`), and operators' decisions
(:mod:`.operator`)."""
