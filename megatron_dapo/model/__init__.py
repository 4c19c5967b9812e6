"""The Megatron-Core policy: model provider, parallel state, logprobs and the DAPO train step."""
