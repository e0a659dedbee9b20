"""The specd daemon: socket server, model worker thread, open buffers, systemd integration."""
