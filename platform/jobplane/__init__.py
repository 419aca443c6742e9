"""jobplane: versioned job templates, durable runs, cooperative workers."""
