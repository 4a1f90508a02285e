"""Image bytes -> exactly Kimi-K3's model input (preprocessing), and the MoonViT-3D tower."""
