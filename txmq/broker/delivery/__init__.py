"""Delivery later: by delay level (:mod:`.schedule`, RocketMQ's ScheduleMessageService, also
the retries' way back) and at an exact time (:mod:`.timer`, RocketMQ 5's timer)."""
