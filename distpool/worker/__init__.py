"""What prefill and decode workers share: their configuration and the worker base."""
