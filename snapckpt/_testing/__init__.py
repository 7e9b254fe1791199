"""The fault-injection toolkit for tests (storage that fails on purpose). Production code never imports it
statically; the storage factory loads it only when ``SNAPCKPT_FAULT_STORAGE`` is set."""
