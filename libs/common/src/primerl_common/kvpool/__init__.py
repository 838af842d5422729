"""The KV-cache pool's shared side (kvstore.v1), used by the kvstore service and by the
services that read and write the pool (inference's KV connector), so that those need no
dependency on the store itself:

- `keys`: the block key (model, parallel rank, policy-version namespace, content hash), and the
  cache salt a replica gives a request (the policy version it serves it at, then the caller's);
- `framing`: blocks on the gRPC streams as raw bytes, with no protobuf copy of the data;
- `bulk`: the bulk side channel's wire format and its client;
- `client`: `KvStoreClient`, which puts and gets blocks across the pool's nodes.
"""
