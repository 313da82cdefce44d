"""Request codes: which operation a frame asks for (RocketMQ's numbers where it has one)."""

from __future__ import annotations

import enum

__all__ = ["RequestCode"]


class RequestCode(enum.IntEnum):
    # client -> broker
    SEND_MESSAGE = 10
    PULL_MESSAGE = 11
    QUERY_MESSAGE_BY_KEY = 12
    QUERY_CONSUMER_OFFSET = 14
    UPDATE_CONSUMER_OFFSET = 15
    UPDATE_AND_CREATE_TOPIC = 17
    GET_ALL_TOPIC_CONFIG = 21
    GET_BROKER_RUNTIME_INFO = 28
    SEARCH_OFFSET_BY_TIMESTAMP = 29
    GET_MAX_OFFSET = 30
    GET_MIN_OFFSET = 31
    VIEW_MESSAGE_BY_ID = 33
    HEARTBEAT = 34
    UNREGISTER_CLIENT = 35
    CONSUMER_SEND_MSG_BACK = 36
    END_TRANSACTION = 37
    GET_CONSUMER_LIST_BY_GROUP = 38
    LOCK_BATCH_MQ = 41
    UNLOCK_BATCH_MQ = 42
    GET_ALL_CONSUMER_OFFSETS = 43
    # name server (GET_ROUTE_INFO is answered by brokers too, each for itself)
    REGISTER_BROKER = 103
    UNREGISTER_BROKER = 104
    GET_ROUTE_INFO = 105
    GET_BROKER_CLUSTER_INFO = 106
    # consumer-group configs (RocketMQ's SubscriptionGroupConfig)
    UPDATE_AND_CREATE_SUBSCRIPTIONGROUP = 200
    GET_ALL_SUBSCRIPTIONGROUP_CONFIG = 201
    GET_TOPIC_STATS = 202
    GET_CONSUMER_CONNECTION_LIST = 203
    DELETE_SUBSCRIPTIONGROUP = 207
    DELETE_TOPIC = 215
    INVOKE_BROKER_TO_RESET_OFFSET = 222
    SEND_BATCH_MESSAGE = 320
    DLQ_LIST = 351
    DLQ_RESEND = 352
    GET_TRANSACTIONS = 353
    DECIDE_TRANSACTION = 354
    #: RocketMQ 5.3's recall of a timer message
    RECALL_MESSAGE = 370
    # RocketMQ 5's pop consumption (what a gRPC proxy asks the broker that holds the queues):
    # RocketMQ's 200050, 200051 and 200053 without their middle zeros (a frame's code has
    # 16 bits)
    POP_MESSAGE = 2050
    ACK_MESSAGE = 2051
    CHANGE_MESSAGE_INVISIBLETIME = 2053
    #: txmq's own: dead-letter a popped message; a consumer group's config; several sends
    POP_DEAD_LETTER = 355
    GET_SUBSCRIPTIONGROUP_CONFIG = 356
    SEND_MESSAGES = 357
    # users and rules (RocketMQ 5's ACL 2.0 AUTH_* requests)
    AUTH_CREATE_USER = 3001
    AUTH_DELETE_USER = 3003
    AUTH_GET_USER = 3004
    AUTH_LIST_USER = 3005
    AUTH_CREATE_ACL = 3006
    AUTH_DELETE_ACL = 3008
    # controller (RocketMQ 5's controller mode)
    CONTROLLER_HEARTBEAT = 1001
    CONTROLLER_ELECT_MASTER = 1002
    CONTROLLER_GET_REPLICA_INFO = 1003
    # broker set: a slave -> its master's HA port
    HA_HELLO = 1101
    HA_TRANSFER = 1102
    HA_GET_METADATA = 1103
    HA_HAND_BACK_OFFSETS = 1104
    # broker -> client
    NOTIFY_CONSUMER_IDS_CHANGED = 40
    CHECK_TRANSACTION_STATE = 39
    RESET_CONSUMER_CLIENT_OFFSET = 220
