"""The checkpoint core: format, storage, planning, save, load and async save."""
