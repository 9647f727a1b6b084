"""Drop-in modules for code written against other libraries (:mod:`.arcface_torch`)."""
