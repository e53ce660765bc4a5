"""The local lab: real LXC containers, fakepve and moto S3 on loopback, standing in for a Proxmox GPU host."""
