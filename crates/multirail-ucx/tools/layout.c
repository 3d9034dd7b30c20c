/* Prints sizeof/offsetof of the UCP structs and the constants mirrored by
 * crates/multirail-ucx/src/sys.rs, for checking them against a UCX's headers:
 *
 *   gcc -I<prefix>/include layout.c -o layout && ./layout
 *
 * <prefix>/include is /usr/include for Debian's libucx-dev, or
 * <site-packages>/libucx/include for the libucx-cu12 wheel. Checked with 1.13.1 (Debian 12) and
 * 1.22.0 (wheel): the common fields have the same offsets, 1.22 only appends fields; the values
 * asserted in sys.rs are the 1.22 ones. Not built by cargo. */
#include <stdio.h>
#include <stddef.h>
#include <ucp/api/ucp.h>
#define S(t) printf("sizeof %s = %zu\n", #t, sizeof(t))
#define O(t,f) printf("  %s.%s = %zu\n", #t, #f, offsetof(t,f))
int main(void) {
  printf("version %d.%d\n", UCP_API_MAJOR, UCP_API_MINOR);
  printf("sizeof ucs_status_t = %zu\n", sizeof(ucs_status_t));
  S(ucp_params_t); O(ucp_params_t,field_mask); O(ucp_params_t,features); O(ucp_params_t,request_size);
  O(ucp_params_t,request_init); O(ucp_params_t,request_cleanup); O(ucp_params_t,tag_sender_mask);
  O(ucp_params_t,mt_workers_shared); O(ucp_params_t,estimated_num_eps); O(ucp_params_t,estimated_num_ppn); O(ucp_params_t,name);
  S(ucp_worker_params_t); O(ucp_worker_params_t,field_mask); O(ucp_worker_params_t,thread_mode); O(ucp_worker_params_t,cpu_mask);
  O(ucp_worker_params_t,events); O(ucp_worker_params_t,user_data); O(ucp_worker_params_t,event_fd); O(ucp_worker_params_t,flags);
  O(ucp_worker_params_t,name); O(ucp_worker_params_t,am_alignment); O(ucp_worker_params_t,client_id);
  S(ucp_ep_params_t); O(ucp_ep_params_t,field_mask); O(ucp_ep_params_t,address); O(ucp_ep_params_t,err_mode);
  O(ucp_ep_params_t,err_handler); O(ucp_ep_params_t,user_data); O(ucp_ep_params_t,flags); O(ucp_ep_params_t,sockaddr);
  O(ucp_ep_params_t,conn_request); O(ucp_ep_params_t,name); O(ucp_ep_params_t,local_sockaddr);
  S(ucp_err_handler_t); S(ucs_sock_addr_t);
  S(ucp_mem_map_params_t); O(ucp_mem_map_params_t,field_mask); O(ucp_mem_map_params_t,address); O(ucp_mem_map_params_t,length);
  O(ucp_mem_map_params_t,flags); O(ucp_mem_map_params_t,prot); O(ucp_mem_map_params_t,memory_type);
  S(ucp_request_param_t); O(ucp_request_param_t,op_attr_mask); O(ucp_request_param_t,flags); O(ucp_request_param_t,request);
  O(ucp_request_param_t,cb); O(ucp_request_param_t,datatype); O(ucp_request_param_t,user_data); O(ucp_request_param_t,reply_buffer);
  O(ucp_request_param_t,memory_type); O(ucp_request_param_t,recv_info); O(ucp_request_param_t,memh);
  S(ucp_ep_attr_t); O(ucp_ep_attr_t,field_mask); O(ucp_ep_attr_t,name); O(ucp_ep_attr_t,local_sockaddr); O(ucp_ep_attr_t,remote_sockaddr);
#if UCP_API_MINOR >= 14
  O(ucp_ep_attr_t,transports); S(ucp_transports_t); S(ucp_transport_entry_t);
  O(ucp_transports_t,entries); O(ucp_transports_t,num_entries); O(ucp_transports_t,entry_size);
  printf("UCP_EP_ATTR_FIELD_TRANSPORTS=%d\n", UCP_EP_ATTR_FIELD_TRANSPORTS);
#endif
  printf("FEATURE_RMA=%d WAKEUP=%d ERR_MODE_PEER=%d CLOSE_FORCE=%d THREAD_SINGLE=%d SERIALIZED=%d MEM_HOST=%d\n",
    UCP_FEATURE_RMA, UCP_FEATURE_WAKEUP, UCP_ERR_HANDLING_MODE_PEER, UCP_EP_CLOSE_FLAG_FORCE,
    UCS_THREAD_MODE_SINGLE, UCS_THREAD_MODE_SERIALIZED, UCS_MEMORY_TYPE_HOST);
  printf("PARAM FEATURES=%d MT=%d NAME=%d | WORKER THREAD_MODE=%d | EP ADDR=%d ERRMODE=%d ERRH=%d | MEM ADDR=%d LEN=%d FLAGS=%d | OP MEMH=%d FLAGS=%d | EPATTR NAME=%d\n",
    UCP_PARAM_FIELD_FEATURES, UCP_PARAM_FIELD_MT_WORKERS_SHARED, UCP_PARAM_FIELD_NAME, UCP_WORKER_PARAM_FIELD_THREAD_MODE,
    UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE, UCP_EP_PARAM_FIELD_ERR_HANDLER,
    UCP_MEM_MAP_PARAM_FIELD_ADDRESS, UCP_MEM_MAP_PARAM_FIELD_LENGTH, UCP_MEM_MAP_PARAM_FIELD_FLAGS,
    UCP_OP_ATTR_FIELD_MEMH, UCP_OP_ATTR_FIELD_FLAGS, UCP_EP_ATTR_FIELD_NAME);
  printf("MEM PROT=%d MEMORY_TYPE=%d | MEM_CUDA=%d\n", UCP_MEM_MAP_PARAM_FIELD_PROT,
    UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE, UCS_MEMORY_TYPE_CUDA);
  return 0;
}
