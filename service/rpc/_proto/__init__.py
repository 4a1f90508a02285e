"""Generated from proto/kimi/vision/v1/vision.proto by proto/generate.py; do not edit."""
