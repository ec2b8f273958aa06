"""The engine host and the engines it runs: admission, recovery, the watchdog, LoRA, classification, memory sizing."""
