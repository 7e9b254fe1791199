"""Private helpers of the core (environment knobs, owner-only directories, progress bars, fault points).
Nothing here is public API."""
