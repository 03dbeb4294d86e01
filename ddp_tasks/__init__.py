"""Host-side tasks for invoke: pure command-line builders plus thin task wrappers."""
