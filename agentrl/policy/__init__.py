"""Policy backends behind one protocol: ``generate(requests) -> results``."""

from ..lazy_exports import lazy_exports

# each module's names are imported on first use (agentrl.lazy_exports): the CLI imports
# this package, and most commands need no torch
__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".base": ["GenerateRequest", "GenerateResult", "Policy", "RequestControl", "SamplingParams",
        "action_text", "request_seed", "stop_string_hit"],
    ".batching": ["MicroBatcher"],
    ".for_run": ["open_policy", "policy_for_run"],
    ".hf": ["HFPolicy", "sampling_logprobs"],
    ".mock": ["MockPolicy"],
    ".openai": ["OpenAIPolicy"],
    ".prefix_cache": ["CacheStats", "PrefixCache"],
    ".registry": ["BACKENDS", "make_policy"],
    ".snapshot": ["SnapshotPolicy"],
})
