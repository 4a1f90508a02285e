"""The serving layer, split by idea: `engine/` (the one transport-free road from bytes to rows,
counts, prompts, encodings and generations), the faces that call it (`rpc/` for gRPC, `batch/`,
`cli/`), `checkpoints/` (writing the tiny default, quantising), and what they share (`errors`,
`admission`, `metrics`, `logs`). Imports vision/ and textcore/, never the reverse."""
