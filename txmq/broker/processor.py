"""The broker's request table: each request class of :mod:`txmq.protocol.wire` and the service
method that answers it.  Only the router (:class:`txmq.protocol.rpc.Router`) sees frames; the
services take typed requests and return typed answers."""

from __future__ import annotations

from dataclasses import dataclass

from txmq.broker.admin import AdminService
from txmq.broker.consumption.pulling import PullService
from txmq.broker.consumption.retry import RetryService
from txmq.broker.proxied import ProxyRequests
from txmq.broker.sending import SendService
from txmq.broker.state.groups import GroupService
from txmq.broker.state.locks import LockService
from txmq.broker.transactions.check import TransactionChecker
from txmq.broker.transactions.operator import OperatorDecisions
from txmq.broker.transactions.service import TransactionService
from txmq.protocol.rpc import Gate, Router
from txmq.protocol.wire import (
    AckMessage,
    ChangeInvisibleTime,
    ConsumerSendMsgBack,
    DeadLetterPopped,
    DecideTransaction,
    DeleteSubscriptionGroup,
    DeleteTopic,
    DlqList,
    DlqResend,
    EndTransaction,
    GetAllConsumerOffsets,
    GetAllSubscriptionGroups,
    GetAllTopicConfig,
    GetBrokerRuntimeInfo,
    GetConsumerConnectionList,
    GetConsumerListByGroup,
    GetMaxOffset,
    GetMinOffset,
    GetSubscriptionGroup,
    GetTopicRoute,
    GetTopicStats,
    GetTransactions,
    Heartbeat,
    LockBatchMq,
    PopMessage,
    PullMessage,
    QueryConsumerOffset,
    QueryMessageByKey,
    RecallMessage,
    ResetOffset,
    SearchOffset,
    SendBatchMessage,
    SendMessage,
    SendMessages,
    UnlockBatchMq,
    UnregisterClient,
    UpdateAndCreateTopic,
    UpdateConsumerOffset,
    UpdateSubscriptionGroup,
    ViewMessageById,
)
from txmq.security.acl.service import AclService

__all__ = ["Services", "request_router"]


@dataclass(slots=True, frozen=True)
class Services:
    sending: SendService
    pulling: PullService
    groups: GroupService
    locks: LockService
    retry: RetryService
    transactions: TransactionService
    checker: TransactionChecker
    decisions: OperatorDecisions
    admin: AdminService
    acl: AclService


def request_router(
    s: Services, guard: Gate | None = None, proxied: ProxyRequests | None = None
) -> Router:
    """Every request a broker answers, and who answers it (``guard``: its access control;
    ``proxied``: what gRPC proxies ask beside, RocketMQ 5's pop consumption)."""
    r = Router("this broker", guard)
    # messages
    r.route(SendMessage, s.sending.send_message)
    r.route(SendBatchMessage, s.sending.send_batch)
    r.route(RecallMessage, s.sending.recall)
    r.route(PullMessage, s.pulling.pull)
    r.route(ConsumerSendMsgBack, s.retry.send_back)
    r.route(EndTransaction, s.transactions.end_transaction)
    # consumer offsets
    r.route(QueryConsumerOffset, s.pulling.query_offset)
    r.route(UpdateConsumerOffset, s.pulling.update_offset)
    r.route(GetMaxOffset, s.pulling.max_offset)
    r.route(GetMinOffset, s.pulling.min_offset)
    # clients and groups
    r.route(Heartbeat, s.groups.heartbeat)
    r.route(UnregisterClient, s.groups.unregister)
    r.route(GetConsumerListByGroup, s.groups.consumer_list)
    r.route(GetConsumerConnectionList, s.groups.connection_list)
    r.route(LockBatchMq, s.locks.lock_batch)
    r.route(UnlockBatchMq, s.locks.unlock_batch)
    # topics and routes
    r.route(GetTopicRoute, s.admin.route_info)
    r.route(UpdateAndCreateTopic, s.admin.create_topic)
    r.route(DeleteTopic, s.admin.delete_topic)
    r.route(GetAllTopicConfig, s.admin.all_topics)
    r.route(GetTopicStats, s.admin.topic_stats)
    # consumer-group configs
    r.route(UpdateSubscriptionGroup, s.admin.update_group)
    r.route(GetAllSubscriptionGroups, s.admin.all_groups)
    r.route(DeleteSubscriptionGroup, s.admin.delete_group)
    # operators
    r.route(ViewMessageById, s.admin.view_message)
    r.route(QueryMessageByKey, s.admin.query_by_key)
    r.route(GetAllConsumerOffsets, s.admin.all_offsets)
    r.route(SearchOffset, s.admin.search_offset)
    r.route(ResetOffset, s.admin.reset_offset)
    r.route(GetBrokerRuntimeInfo, s.admin.runtime_info)
    r.route(DlqList, s.retry.dlq_list)
    r.route(DlqResend, s.retry.dlq_resend)
    r.route(GetTransactions, s.checker.list_transactions)
    r.route(DecideTransaction, s.decisions.decide)
    if proxied is not None:  # gRPC proxies
        r.route(SendMessages, proxied.send_many)
        r.route(PopMessage, proxied.pop)
        r.route(AckMessage, proxied.ack)
        r.route(ChangeInvisibleTime, proxied.change_invisible)
        r.route(DeadLetterPopped, proxied.dead_letter)
        r.route(GetSubscriptionGroup, proxied.group_config)
    # users and rules
    s.acl.route(r)
    return r
