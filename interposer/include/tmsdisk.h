/* SPDX-License-Identifier: Apache-2.0 */
/* tmsdisk.h: the in-process C API of libtmsdisk.so (pause/resume this process's GPU memory).
 *
 * Every function returns 0 on success or a negative errno value, never throws and never exits.
 * From Python:
 *   lib = ctypes.CDLL("libtmsdisk.so")      # or ctypes.CDLL(None) when it is LD_PRELOADed
 *   if lib.tmsdisk_pause() != 0: ...
 * While paused, CUDA calls that submit work or touch device memory (launches, copies, sets...) are
 * held, resume automatically or fail, as TMSDISK_ON_TOUCH says (README.md); a thread that pauses
 * its own process must not launch work before it resumes unless the policy is resume or fail.
 * After a resume that could not restore some allocations because their backup is damaged, the
 * process runs and only calls naming that memory follow TMSDISK_ON_TOUCH (damaged_allocations). */
#ifndef TMSDISK_H
#define TMSDISK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TMSDISK_API_VERSION 8

#if defined(__cplusplus)
#define TMSDISK_NOEXCEPT noexcept
#else
#define TMSDISK_NOEXCEPT
#endif

/* tmsdisk_status.state */
enum {
  TMSDISK_STATE_RUNNING = 0,
  TMSDISK_STATE_PAUSING = 1,
  TMSDISK_STATE_PAUSED = 2,
  TMSDISK_STATE_RESUMING = 3,
  TMSDISK_STATE_PARTIALLY_PAUSED = 4 /* a pause or resume failed half-way (or found a damaged backup);
                                        see last_message and damaged_allocations */
};

/* Indexes of tmsdisk_status.unmanaged_bytes: why bytes stay resident. */
enum {
  TMSDISK_UNMANAGED_SMALL = 0, /* below TMSDISK_MIN_BYTES */
  TMSDISK_UNMANAGED_EXPORTED = 1,
  TMSDISK_UNMANAGED_IMPORTED = 2,
  TMSDISK_UNMANAGED_MULTICAST = 3,
  TMSDISK_UNMANAGED_POOL = 4,
  TMSDISK_UNMANAGED_MANAGED_MEMORY = 5,
  TMSDISK_UNMANAGED_OTHER = 6,    /* e.g. the device has no virtual memory management */
  TMSDISK_UNMANAGED_RESIDENT = 7, /* allocated under a tag with TMSDISK_POLICY_RESIDENT (API version 4) */
  TMSDISK_UNMANAGED_REASONS = 8
};

struct tmsdisk_status {
  uint32_t state;     /* TMSDISK_STATE_* */
  uint32_t connected; /* 1 while a session with tmsdiskd is open */
  uint32_t enabled;   /* 1 when libcuda was found and the shim manages allocations */
  uint32_t managed_allocations;
  uint32_t paused_allocations;
  int32_t last_error; /* positive errno of the last pause/resume, 0 if it succeeded */
  uint64_t session_id;
  uint64_t resident_bytes; /* managed bytes in GPU memory */
  uint64_t paused_bytes;   /* managed bytes on disk */
  uint64_t unmanaged_bytes[TMSDISK_UNMANAGED_REASONS];
  uint64_t last_pause_bytes;
  uint64_t last_pause_ns;
  uint64_t last_resume_bytes;
  uint64_t last_resume_ns;
  char last_message[256]; /* what the last pause/resume said, NUL-terminated */
  /* Added in API version 2. Paused allocations a resume could not restore because their backup is
   * damaged (also counted in paused_allocations/paused_bytes): the process runs, their memory is
   * unmapped until tmsdisk_resume restores them (once the file is repaired) or
   * tmsdisk_resume_accept_loss replaces them with zero-filled memory. */
  uint32_t damaged_allocations;
  uint64_t damaged_bytes;
};

/* Pauses this process: every managed allocation is written to disk through tmsdiskd and its GPU
 * memory released; virtual addresses stay valid. Blocks until done. Returns 0, or -errno:
 * -EBUSY (another pause/resume runs), -ENOSPC (no room on disk: nothing changed), -ECONNREFUSED or
 * -ENOENT (no daemon), -ENOTSUP (no usable libcuda), -EIO... On failure, allocations not yet
 * written stay resident and intact; the state says whether some are paused. */
int tmsdisk_pause(void) TMSDISK_NOEXCEPT;

/* Brings every paused allocation back at its address, verified against its checksums. Returns 0 or
 * -errno (-EBADMSG: a chunk failed verification, -EIO: a chunk could not be read, -ENODATA: a chunk is
 * missing; that allocation stays paused, its file is kept, and the rest of the process runs:
 * tmsdisk_status().damaged_allocations and last_message name it). Retries damaged allocations. */
int tmsdisk_resume(void) TMSDISK_NOEXCEPT;

/* tmsdisk_resume, except that an allocation whose backup is damaged gets zero-filled memory at its
 * address (same properties and access) instead of staying paused: its data is LOST, which the
 * caller accepts (logged at error level, and said in last_message). Returns 0 when every allocation
 * is resident, as tmsdisk_resume does otherwise. Added in API version 2. */
int tmsdisk_resume_accept_loss(void) TMSDISK_NOEXCEPT;

/* Fills the first `size` bytes of *status (pass sizeof(struct tmsdisk_status)); fields added in
 * later versions go at the end. Returns 0 or -EINVAL. */
int tmsdisk_status(struct tmsdisk_status* status, size_t size) TMSDISK_NOEXCEPT;

/* Registers callback(arg) to run before each pause of this process, before CUDA calls are held: it
 * hands back memory the program does not need, so that the pause does not move it (the start-up
 * module `tmsctl run` puts on the Python path registers one that calls torch.cuda.empty_cache()).
 * Callbacks run in the order registered, on a thread of the shim's own (not the caller of
 * tmsdisk_pause, nor the thread that registered them) that is like any thread of the program: its
 * CUDA calls go through the shim (cuMemFree of managed memory releases it). A pause waits for them
 * at most TMSDISK_PAUSE_CALLBACK_TIMEOUT_MS (default 30 s) and then goes on without them, so a
 * callback must return promptly and must not wait for what a thread that pauses holds (a Python
 * callback needs the GIL: call tmsdisk_pause through ctypes.CDLL, which releases it, not PyDLL).
 * One that returns late runs while the process pauses, as any other thread would. A callback must not
 * call tmsdisk_pause or tmsdisk_resume (-EBUSY), nor throw.
 * They run only for a pause that has work to do (some managed memory resident, nothing paused), not
 * for a resume, nor again while those of an earlier pause have not returned.
 * Returns 0 (also when the same callback and arg are registered already), -EINVAL for a null
 * callback, -ENOSPC when 16 are registered. There is no way to unregister one: arg must stay valid for
 * the life of the process. Added in API version 3. */
int tmsdisk_on_pause(void (*callback)(void* arg), void* arg) TMSDISK_NOEXCEPT;

/* Tags (API version 4): the parts of a process ("weights", "kv_cache"), paused and resumed apart.
 * Every allocation a thread makes between tmsdisk_tag_push and the matching tmsdisk_tag_pop carries
 * the innermost tag pushed on that thread, and its policy; allocations made outside any region carry
 * TMSDISK_UNTAGGED, a tag like the others. Other threads are not affected. Policies:
 *   BACKUP    the pause saves the bytes (host tier, disk) and the resume brings them back;
 *   DISCARD   the pause releases the memory without saving it; the resume maps new memory at the same
 *             addresses, zero-filled (time proportional to mapping, not to bytes): a KV cache, CUDA-graph
 *             scratch, anything whose content is garbage between phases;
 *   RESIDENT  never paused (the driver's own allocation, counted as TMSDISK_UNMANAGED_RESIDENT).
 * After a pause of one tag, the rest of the program runs; CUDA calls naming paused memory wait for
 * its resume (TMSDISK_ON_TOUCH), kernels must not touch it. Tags with BACKUP allocations pause one
 * after another and resume apart, each keeping the others paused as they are stored; tmsdisk_pause()
 * while some tags are paused keeps them the same way and saves the rest. */
enum { TMSDISK_POLICY_BACKUP = 0, TMSDISK_POLICY_DISCARD = 1, TMSDISK_POLICY_RESIDENT = 2 };
#define TMSDISK_TAG_MAX 63          /* tag names: 1 to 63 of A-Z a-z 0-9 _ . - */
#define TMSDISK_UNTAGGED "untagged" /* the tag of allocations made outside any region */

/* This thread's allocations carry `tag` with `policy` until the matching pop; regions nest. Returns 0,
 * -EINVAL (bad name or policy), -ENOSPC (deeper than 32, or more than 1023 distinct tags). */
int tmsdisk_tag_push(const char* tag, int policy) TMSDISK_NOEXCEPT;
/* Ends this thread's innermost region. Returns 0, or -ENOENT when none is open. */
int tmsdisk_tag_pop(void) TMSDISK_NOEXCEPT;
/* tmsdisk_pause / tmsdisk_resume of the allocations carrying `tag` only (NULL: every allocation).
 * A tag no allocation ever carried is nothing to do (0). */
int tmsdisk_pause_tag(const char* tag) TMSDISK_NOEXCEPT;
int tmsdisk_resume_tag(const char* tag) TMSDISK_NOEXCEPT;
/* tmsdisk_resume_tag, except that an allocation of that tag whose backup is damaged gets zero-filled
 * memory, as tmsdisk_resume_accept_loss does for the whole process (NULL: it is that call); the other
 * tags' damaged allocations stay paused. The same as `tmsctl resume --tag TAG --accept-loss`. Added in
 * API version 5. */
int tmsdisk_resume_tag_accept_loss(const char* tag) TMSDISK_NOEXCEPT;

struct tmsdisk_tag_info {
  char tag[64];    /* NUL-terminated */
  uint32_t policy; /* TMSDISK_POLICY_BACKUP or _DISCARD (resident memory is in unmanaged_bytes) */
  uint32_t allocations;
  uint32_t paused_allocations;
  uint32_t reserved;
  uint64_t resident_bytes;
  uint64_t paused_bytes;
};
/* One entry per (tag, policy) that managed allocations carry now, in the first `count` entries of
 * `out`, each `size` bytes apart (pass sizeof(struct tmsdisk_tag_info)). Returns how many there are
 * (more than `count`: call again with more room), or -EINVAL. */
int tmsdisk_tags(struct tmsdisk_tag_info* out, size_t count, size_t size) TMSDISK_NOEXCEPT;

/* The rank's store of named objects (API version 6): byte arrays kept in tmsdiskd's files while the
 * process runs, written and read in ranges; what streams an optimizer's state through the step
 * (python: tmsdisk.optim). Objects belong to the rank: kept across a daemon restart, removed when the
 * process exits, never moved by a pause (a pause queued after writes waits for them). Bytes travel
 * as a pause's do: staging slots, O_DIRECT, an XXH3-128 seal per chunk, verified on every read. A new
 * object that fits the rank's share of the node's host tier lives there instead, all of it: its
 * ranges are DMA copies into and out of memory mapped in the process (TMSDISK_STORE_HOST_TIER=0: never). */
/* The chunk size of this rank's session: ranges start at multiples of it. 0 without a session. */
uint64_t tmsdisk_store_chunk_bytes(void) TMSDISK_NOEXCEPT;
/* The handle of object `name` (1-127 of A-Z a-z 0-9 _ . -), created with `size` bytes when missing.
 * Returns 0, -EINVAL (bad name or size), -EEXIST (it exists with another size: remove it first),
 * -EDQUOT (over the user's max-chunks-per-uid, each object counting 16 chunks more for its records),
 * -E2BIG (more than 65536 objects, or 2^26 of their chunks, in one rank), -ECONNREFUSED/-ENOENT (no
 * daemon)... */
int tmsdisk_store_open(const char* name, uint64_t size, uint64_t* handle) TMSDISK_NOEXCEPT;
/* Deletes object `name` and its files' space. Returns 0 or -ENOENT. */
int tmsdisk_store_remove(const char* name) TMSDISK_NOEXCEPT;
/* Queues a write of [src, src + length) (device memory, or host memory) to the object at `offset`,
 * after the work queued on `stream` (a CUstream; NULL: the legacy default stream) until now. All or
 * nothing: a reader sees the old bytes of the range or the new ones, never a mix, also after a
 * daemon killed mid-write. `src` must not change until the write is done. offset is a multiple of
 * tmsdisk_store_chunk_bytes(), the range inside the object, ending at a multiple of it or at the
 * object's end. *ticket gets what to wait for. Refused at once: -EINVAL (a bad range, or device
 * memory of no context this thread can reach), -EBUSY (`stream` is being captured into a CUDA graph:
 * the bytes would be read before the captured work ran). A range whose memory is paused when its turn
 * comes ends with -EAGAIN (resume, then queue it again). */
int tmsdisk_store_write(uint64_t handle, uint64_t offset, const void* src, uint64_t length, void* stream,
                        uint64_t* ticket) TMSDISK_NOEXCEPT;
/* Queues a read of the object's current bytes [offset, offset + length) into dst, after the work
 * queued on `stream` until now (dst must not be in use until the read is done), and after every
 * write queued before it. */
int tmsdisk_store_read(uint64_t handle, uint64_t offset, void* dst, uint64_t length, void* stream,
                       uint64_t* ticket) TMSDISK_NOEXCEPT;
/* A hint that the range will be read soon. Returns 0. */
int tmsdisk_store_prefetch(uint64_t handle, uint64_t offset, uint64_t length) TMSDISK_NOEXCEPT;
/* Blocks until the operation `ticket` names is done; its outcome: 0, -ENODATA (read of bytes never
 * written), -EBADMSG (a chunk failed verification), -EAGAIN (its memory was paused), -EIO,
 * -ECONNRESET/-ECONNREFUSED (the daemon went: what was committed stays, the next call reconnects),
 * -EINVAL (no such ticket, or waited for already). Each ticket is waited for once (or, a write's,
 * left to tmsdisk_store_flush). */
int tmsdisk_store_wait(uint64_t ticket) TMSDISK_NOEXCEPT;
/* Blocks until every write queued so far is done: the first error among the writes since the last
 * flush, 0 if none. */
int tmsdisk_store_flush(void) TMSDISK_NOEXCEPT;

/* Paused memory read without resuming it (API version 7): what a weight sync reads from a paused
 * trainer (torch_memory_saver's get_cpu_backup). The range stays paused; its chunks come from the host
 * tier, the disk (verified against their seals) or nowhere (zero chunks). A read of a range being
 * paused or resumed waits for that to finish. Not from a tmsdisk_on_pause callback (the pause waits
 * for it). */
/* Copies the paused bytes of [ptr, ptr + length) (inside one allocation tmsdisk manages) into host
 * memory dst (of resident memory, its retained copy: tmsdisk_retain_host_copy). Returns 0; -ENODATA
 * when the range is resident with no retained copy of all of it (the device holds its bytes: read
 * them there) or was paused without a backup (a discard tag); -EINVAL (not in one managed allocation),
 * -EBADMSG (a chunk on disk failed verification), -EIO, -ECONNREFUSED (no daemon)... */
int tmsdisk_read_paused(const void* ptr, uint64_t length, void* dst) TMSDISK_NOEXCEPT;
/* *view = the host copy of [ptr, ptr + length) where none of it lies on disk, no copy: read-only
 * memory mapped in the process (the node's host tier, zero pages for zero chunks), pinned with CUDA
 * where the whole allocation is in it. Its address stays the same for as long as the allocation has a
 * host copy: while paused, after a resume that retains it (tmsdisk_retain_host_copy) and in the
 * allocation's later pauses, which it then shows. It goes (unmapped) when the allocation is freed or
 * resumed without retaining, as torch_memory_saver's pinned copy does. Returns 0; -ENODATA when any
 * chunk of the range lies on disk (copy it with tmsdisk_read_paused), or as tmsdisk_read_paused
 * (API version 8: before, views were of paused memory only, valid until its resume). */
int tmsdisk_paused_view(const void* ptr, uint64_t length, const void** view) TMSDISK_NOEXCEPT;
/* Starts reading the paused memory of tag `tag` (NULL: all paused memory) from disk into the node's
 * host tier ahead of its resume, in the order the resume wants it, as far as the rank's share of the
 * tier goes; the resume then copies that part from memory and reads only the rest from disk. Runs in
 * the background between the shim's other work: a pause or resume that comes meanwhile goes first and
 * ends it (what was read by then is used). wait = 0 returns once it started, 1 once it ended. Returns
 * 0 (also when nothing of it is on disk); -ENOTSUP (TMSDISK_HOST_TIER=0), -ENOSPC (the node's tier has
 * no room for this rank now), -EINVAL (a bad tag name), -EBADMSG (with wait: a chunk failed
 * verification), -ECONNREFUSED (no daemon)... (API version 7) */
int tmsdisk_prefetch(const char* tag, int wait) TMSDISK_NOEXCEPT;
/* on = 1: from now on, a resume leaves the host chunks it copied back in the node's host tier, as
 * the resumed memory's retained copy (torch_memory_saver's retain_cpu_backup): tmsdisk_read_paused
 * then copies resident memory from it, as it was when paused, until that memory is used again (the
 * next pause, a prefetch, or the daemon asking for it back); an allocation whose copy has a view
 * (tmsdisk_paused_view) keeps it there, in memory of the process's own once the tier's is reused,
 * until it is freed or resumed without retaining. on = 0: off (the default); on < 0: leaves it as it
 * is. Returns the setting before (1 or 0). (API version 7) */
int tmsdisk_retain_host_copy(int on) TMSDISK_NOEXCEPT;
/* The directory this process's files go in from now on (torch_memory_saver's set_disk_backup_dir;
 * TMS_DISK_BACKUP_DIR names the first): a directory of the caller's own, writable by no one else, on
 * a disk (tmpfs is refused unless tmsdiskd allows it). The shim opens it and hands tmsdiskd the
 * descriptor; the rank's files are then named "tmsdisk-<job>-rank<R>-<pid>.*" in it, beside anything
 * else there, and removed when the process exits. One of tmsdiskd's roots brings back its usual layout.
 * Returns 0; -EBUSY while any memory of the process is paused (or being paused or resumed), or while
 * it stores objects (tmsdisk_store_open): its files stay where they are; -EACCES (not the caller's
 * directory, or writable by others), -EINVAL (tmpfs), -ENOENT/-ENOTDIR (no such directory)... The
 * message is in the shim's log. Without a daemon to ask, the next connection hands it over. (API
 * version 8) */
int tmsdisk_set_backup_dir(const char* path) TMSDISK_NOEXCEPT;
/* "tmsdisk <version>"; static storage. */
const char* tmsdisk_version(void) TMSDISK_NOEXCEPT;

#ifdef __cplusplus
}
#endif

#endif /* TMSDISK_H */
