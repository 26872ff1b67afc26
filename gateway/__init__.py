"""The gateway: request lifecycle, the propose -> verify -> commit loop, replica discovery."""
