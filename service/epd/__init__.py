"""Encoder disaggregation (EPD): this server as the encoder of other engines. Each transport is
one module implementing `base.Sink` (an encoding in; its delivery and transfer params out):

- `vllm_storage`: vLLM's shared-storage encoder-cache connector (files under `--ec-export-dir`,
  keyed by vLLM's own mm_hash), for `--ec-role producer` and the gRPC `Encode` export;
- `sglang_zmq`: SGLang's `zmq_to_tokenizer` / `zmq_to_scheduler` pushes (`sglang_wire` is the
  message), for SGLang's encoder protocol (`sglang_encoder`: what its HTTP `/encode` route and its
  gRPC `Encode` share).

The faces only parse their routes into an engine request and a transport's destination; the
engine returns encodings and never writes or sends them. Configuration picks the transport
(`--ec-role producer` the vLLM one; SGLang's routes the ZMQ one): adding one is a module here and
the flag or route that uses it. Nothing is imported here: a module loads only the transport it uses.
"""
