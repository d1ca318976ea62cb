/*
 * bulkhead.h: attach a C or C++ program to a device or view of a running `bulkhead serve`.
 *
 * The program makes its own queues to the device's driver domain and reaches it with no
 * FUSE or NBD hop. A restart of the domain is a pause, never an error. Link with
 * -lbulkhead (target/release/libbulkhead.so, or libbulkhead.a with -lpthread -ldl -lm).
 *
 * Every call that can fail returns 0 or a negative errno, and leaves a message for
 * bulkhead_last_error() in the calling thread. Calls on one queue from several threads take
 * turns; give each thread a queue of its own for parallel I/O.
 */
#ifndef BULKHEAD_H
#define BULKHEAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An attached device or view. */
typedef struct bulkhead_device bulkhead_device;

/* Write flag: the data is durable when the call returns (forced unit access). */
#define BULKHEAD_FUA 1u

/*
 * Attaches to `name` (a device or a view) of the serve whose run directory is `run_dir`,
 * with `queues` queues (1 if 0). Returns NULL on failure, with a negative errno in *err if
 * err is not NULL (-ENOENT: no such device or view or no serve; -EBUSY: no free attach slot;
 * -EACCES: the control socket refused the caller; -EIO otherwise).
 */
bulkhead_device *bulkhead_attach(const char *run_dir, const char *name, unsigned queues, int *err);

/* Detaches and frees `dev` (NULL is ignored). No call on `dev` may run or follow. */
void bulkhead_detach(bulkhead_device *dev);

/* Size in bytes. */
uint64_t bulkhead_size(const bulkhead_device *dev);

/* Queues the device was attached with. */
unsigned bulkhead_queue_count(const bulkhead_device *dev);

/* Whether the device refuses writes (a read-only view). */
int bulkhead_read_only(const bulkhead_device *dev);

/* Reads `len` bytes at `offset` into `buf` on queue `queue`. */
int bulkhead_read(bulkhead_device *dev, unsigned queue, void *buf, size_t len, uint64_t offset);

/* Writes `len` bytes from `buf` at `offset` on queue `queue`; flags: 0 or BULKHEAD_FUA. */
int bulkhead_write(bulkhead_device *dev, unsigned queue, const void *buf, size_t len, uint64_t offset,
                   unsigned flags);

/* Makes every acknowledged write durable. */
int bulkhead_flush(bulkhead_device *dev, unsigned queue);

/* Discards (unmaps) `len` bytes at `offset`. */
int bulkhead_discard(bulkhead_device *dev, unsigned queue, uint64_t offset, uint64_t len);

/* Writes zeroes over `len` bytes at `offset`. */
int bulkhead_write_zeroes(bulkhead_device *dev, unsigned queue, uint64_t offset, uint64_t len);

/*
 * Requests in flight. The bulkhead_submit_* calls place a request on `queue` and return at
 * once; bulkhead_reap hands back the answers under the caller's tokens, in any order. A queue
 * with submitted requests not yet reaped belongs to the thread that submitted them: other
 * threads' calls on it, and the blocking calls above on it, get -EBUSY until all are reaped.
 * When the queue is full, a submit waits for an answer (kept for bulkhead_reap) first.
 * A restart of the domain is a pause, never an error. Requests longer than the queue carries
 * at once go as several pieces and are answered once.
 */

/* One answer: the request's token, and 0 or a negative errno. */
struct bulkhead_completion {
    uint64_t token;
    int result;
};

/* Submits a read of `len` bytes at `offset` into `buf`; `buf` must stay valid, and not be
 * touched, until the answer is reaped. */
int bulkhead_submit_read(bulkhead_device *dev, unsigned queue, void *buf, size_t len, uint64_t offset,
                         uint64_t token);

/* Submits a write of `len` bytes from `buf` at `offset` (copied before the call returns);
 * flags: 0 or BULKHEAD_FUA. */
int bulkhead_submit_write(bulkhead_device *dev, unsigned queue, const void *buf, size_t len, uint64_t offset,
                          unsigned flags, uint64_t token);

/* Submits a flush. */
int bulkhead_submit_flush(bulkhead_device *dev, unsigned queue, uint64_t token);

/* Submits a discard, or a write of zeroes, of `len` bytes at `offset`. */
int bulkhead_submit_discard(bulkhead_device *dev, unsigned queue, uint64_t offset, uint64_t len, uint64_t token);
int bulkhead_submit_write_zeroes(bulkhead_device *dev, unsigned queue, uint64_t offset, uint64_t len,
                                 uint64_t token);

/* Moves up to `max` answers of `queue` into `out`, first waiting until `min` are there (or
 * nothing is in flight). Returns how many, or a negative errno. */
int bulkhead_reap(bulkhead_device *dev, unsigned queue, struct bulkhead_completion *out, unsigned max,
                  unsigned min);

/* The message of the calling thread's last failure ("" if none); valid until its next call. */
const char *bulkhead_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* BULKHEAD_H */
