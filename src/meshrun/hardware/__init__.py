"""What this machine is and computes: the device and backend (`device`), what `precision` means on
it and the one dtype map (`precision`), and the datasheet peaks MFU is measured against (`peaks`)."""
