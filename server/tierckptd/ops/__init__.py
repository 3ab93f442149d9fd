"""Process operations: metrics, systemd notification, allocator tuning."""
