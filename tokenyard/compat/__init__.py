"""Drop-in modules for code written against other EP libraries."""
