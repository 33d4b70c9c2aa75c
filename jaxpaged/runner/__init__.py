"""Host batch -> device arrays -> one jitted model step."""
