"""The steps of an export. They change a job only through store/."""
