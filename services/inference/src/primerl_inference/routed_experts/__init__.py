"""Router replay (R3) capture: the experts each prompt and completion token was routed to.

One array per finished request, `[num_prompt_tokens + num_completion_tokens,
num_hidden_layers, top_k]` expert ids, uint8 (uint16 above 256 experts): the shape and dtype
of vLLM's native capture, which is what `GenerationOutput.routed_experts` carries. The layer
axis is indexed by layer number; in a model whose dense layers are interleaved with MoE ones
those columns stay zero (as in vLLM).

One module per process role:

- `capture` (engine process): `RoutedExpertsCapture` captures the routing inside vLLM's V1
  model runner (vLLM's own capture needs Model Runner V2 and Triton: GPU only, not used
  here). It binds vLLM's own capture callback to each MoE router
  (`bind_routed_experts_capturer`, as the native path does), so the ids are the `topk_ids`
  the engine used, not recomputed. After each forward it stores the rows by KV-cache slot:
  the slot that holds a token's KV also holds its routing. A prefix-cache hit reuses KV
  blocks without forwarding them, and their slots still hold the routing of the forward
  that wrote that KV, so hits are filled exactly, for as long as the KV itself is reusable
  (no separate LRU to fall out of step with the cache). The slots are those of a
  full-attention KV cache group: with sliding-window layers (GPT-OSS, AFMoE) vLLM keeps
  their KV in a group of its own and frees its blocks behind the window, while the full
  attention group keeps a block of every token. A model with no full-attention group has
  its routing kept per request by position instead: a prefix-cache hit then has none for
  its cached tokens (RoutedExpertsUnavailableError). Each slot also records the position
  and token written there; a request whose slots do not all match (KV loaded through a KV
  connector, which forwards nothing here) raises `RoutedExpertsUnavailableError` instead of
  returning another forward's routing. With `PrimerlKVConnector` the routing travels with the
  KV: a block saved to the pool carries the rows of its slots (`block_rows`), and a block
  loaded from it puts them back into the slots it fills (`fill_block`), so a prefix another
  replica computed has complete routing too.
- `worker` (engine process): `RoutedExpertsWorkerExtension`, the worker methods that serve
  the capture through `collective_rpc` (`worker_extension.WorkerExtension` inherits them).
- `client` (service process): `RoutedExpertsClient` calls them. `AsyncLLM` always starts its
  engine core in a child process, even with VLLM_ENABLE_V1_MULTIPROCESSING=0.

The last completion token is sampled but never forwarded, so no engine has its routing; it
only feeds the logits at the last position, which predict nothing and never enter the loss.
Its row repeats the row before it (valid, distinct ids): a trainer may replay it or use its
own top-k there, the loss is the same.
"""

__all__ = ["RoutedExpertsUnavailableError"]


class RoutedExpertsUnavailableError(LookupError):
    """Some tokens of a request have no captured routing (see the package docstring)."""
