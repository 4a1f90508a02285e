"""The serving layer: gRPC service, CLI, checkpoint assembly. Imports vision/ and textcore/, never the reverse."""
