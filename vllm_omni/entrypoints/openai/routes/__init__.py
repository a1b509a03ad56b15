"""The API routes: thin translations between HTTP and the scheduler, one module per API."""
