"""The gRPC face: the server and its handlers, protobuf conversions, interceptors (access log,
bearer token, malformed-protobuf guard), TLS, the Python clients and the generated code."""
