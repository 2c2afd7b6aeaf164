"""The wire: aggregator.proto (outside students and the aggregator) and owner.proto (the coordinator
and the owners' gateways), with their generated modules (``make proto``; a test fails when stale)."""

# The trailing metadata of a budget refusal (aggregator.proto, RESOURCE_EXHAUSTED): how a client
# tells the privacy budget from any other exhausted resource.
REASON_KEY, BUDGET_REASON = "conclave-reason", "privacy-budget"
