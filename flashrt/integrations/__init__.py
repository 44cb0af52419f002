"""Drop-ins for other robot stacks (lerobot); each module imports nothing of the stack it serves."""
