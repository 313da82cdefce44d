"""What the broker keeps and its services share: its settings (:mod:`.config`), the context
each service is built from (:mod:`.context`: the store, the tables, the clock of due times),
topics (:mod:`.topics`), consumer offsets (:mod:`.offsets`), consumer-group configs
(:mod:`.subscriptions`), the groups' members and the requests that keep them
(:mod:`.groups`), queue locks (:mod:`.locks`), the dedupe window (:mod:`.dedupe`),
throughput (:mod:`.stats`), state saved in JSON files (:mod:`.persisting`) and the put path
every writer takes (:mod:`.putting`)."""
