"""The text side of Kimi-K3: tokenizer, chat template, output parser, and the KimiLinear trunk."""
