/* An LD_PRELOAD shim that keeps a process's listeners on loopback.
 *
 * Why: Mooncake's transfer engine binds its handshake and data ports to the wildcard address
 * (every interface) whatever hostname it is given, and it has no switch for it nor any
 * authentication on those ports. On one node nothing outside the machine needs them, so when
 * DSPARK_BIND_LOOPBACK=1 is in the environment this library turns every bind() of a wildcard
 * address into a bind() of the loopback address: 0.0.0.0 -> 127.0.0.1, and :: -> ::1 for an
 * IPv6-only socket or ::ffff:127.0.0.1 for a dual-stack one (so IPv4 clients of 127.0.0.1 still
 * reach it). Binds of a specific address, of other families and every other call go through
 * unchanged. Built and used by cluster/store/loopback.py, for one-node (local) runs only.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int wanted(void) {
    const char *v = getenv("DSPARK_BIND_LOOPBACK");
    return v != NULL && strcmp(v, "1") == 0;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = NULL;
    if (real_bind == NULL)
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr != NULL && wanted()) {
        if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
            struct sockaddr_in a;
            memcpy(&a, addr, sizeof a);
            if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
                a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
            }
        } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
            struct sockaddr_in6 a;
            memcpy(&a, addr, sizeof a);
            if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr)) {
                int v6only = 0;
                socklen_t n = sizeof v6only;
                if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &n) != 0)
                    v6only = 0;
                if (v6only) {
                    a.sin6_addr = in6addr_loopback;
                } else {
                    memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                    a.sin6_addr.s6_addr[10] = 0xff;
                    a.sin6_addr.s6_addr[11] = 0xff;
                    a.sin6_addr.s6_addr[12] = 127;
                    a.sin6_addr.s6_addr[15] = 1;
                }
                return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
            }
        }
    }
    return real_bind(fd, addr, len);
}
