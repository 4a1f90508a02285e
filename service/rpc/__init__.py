"""The gRPC face: the server and its handlers (ours, and SGLang's encoder service), protobuf
conversions, interceptors (access log, bearer token, malformed-protobuf guard), TLS, the Python
clients and the generated code."""

# The HTTP/2 frame size both ends of the gRPC face ask for (the server and the clients).
MAX_FRAME_BYTES = 4 << 20
